"""The contract between compile/ and runtime/: manifest schema, model config and typed errors (stdlib only)."""

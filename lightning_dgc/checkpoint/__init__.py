"""The exchange state in checkpoints: rank files, the manifest, saving, checking, restoring."""

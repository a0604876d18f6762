"""Platform shims: each makes Megatron-Core 0.19.2 run where it otherwise would not (CPU, torch AdamW, a
known-bad pipeline setting) or quiets what it prints on purpose. Nothing else branches on the platform."""

"""The parallel stage: process group, device mesh, FSDP2, activation checkpointing, compile."""

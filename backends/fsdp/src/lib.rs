//! FSDP training layout to tensor-parallel rollout layout on NVIDIA GPUs.

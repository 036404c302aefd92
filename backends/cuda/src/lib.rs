//! Shared NVIDIA GPU plumbing (devices, communicators, pinned pools, streams, kernels) for the GPU backends.

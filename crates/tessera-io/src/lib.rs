//! Tensor files: .npy and .safetensors reading and atomic writing.

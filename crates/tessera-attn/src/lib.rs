//! Attention backends: the Backend trait, the CPU flash-attention kernels, the float64 reference and the conformance suite.

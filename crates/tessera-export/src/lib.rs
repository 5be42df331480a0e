//! Exporters of Tessera plans to JAX Splash MaskInfo and PyTorch FlexAttention BlockMask arrays.

//! Document packing into fixed-length rows with segment ids and positions (SPEC §8).

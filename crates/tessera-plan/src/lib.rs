//! The tile planner: mask + shapes + tile sizes to an explicit block-sparse plan (SPEC §5).

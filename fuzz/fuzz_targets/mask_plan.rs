#![no_main]
//! Fuzz target `mask_plan`: see `tessera::fuzz_entry::mask_plan` for the input layout and the contracts.

use libfuzzer_sys::fuzz_target;
use tessera::fuzz_entry::TrackingAlloc;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| tessera::fuzz_entry::mask_plan(data));

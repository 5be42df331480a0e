#![no_main]
//! Fuzz target `mask_plan`: see `tessera_fuzz_contract::mask_plan` for the input layout and the contracts.

use libfuzzer_sys::fuzz_target;
use tessera_fuzz_contract::TrackingAlloc;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| tessera_fuzz_contract::mask_plan(data));

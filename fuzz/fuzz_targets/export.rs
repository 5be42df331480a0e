#![no_main]
//! Fuzz target `export`: see `tessera_fuzz_contract::export` for the input layout and the contracts.

use libfuzzer_sys::fuzz_target;
use tessera_fuzz_contract::TrackingAlloc;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| tessera_fuzz_contract::export(data));

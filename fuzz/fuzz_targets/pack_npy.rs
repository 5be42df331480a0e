#![no_main]
//! Fuzz target `pack_npy`: see `tessera_fuzz_contract::pack_npy` for the input layout and the contracts.

use libfuzzer_sys::fuzz_target;
use tessera_fuzz_contract::TrackingAlloc;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| tessera_fuzz_contract::pack_npy(data));

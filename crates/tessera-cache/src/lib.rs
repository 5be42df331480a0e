//! Persistent plan cache (memory LRU then disk) with checked entries, and the run manifest (SPEC §7).

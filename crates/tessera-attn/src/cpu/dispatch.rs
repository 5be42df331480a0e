//! Which kernel path each storage dtype runs on this machine: chosen by measured speed, and kept
//! stable per machine.
//!
//! Contract:
//! - Paths: f32 calls run one [`F32Path`] (`avx512`, `avx2`, `portable`: the f32 kernel copies);
//!   bf16 calls run one [`Bf16Path`] (`dot`: the `vdpbf16ps` kernels, AVX512-BF16 only;
//!   `widen-avx512`, `widen-avx2`, `widen-portable`: bf16 widened to f32 in the f32 kernels of
//!   that copy). Only paths this CPU runs ([`Caps`]) are ever chosen. The path names,
//!   [`Caps`] and the [`ENV`] syntax live in `paths` (below the backend, which refuses paths
//!   this CPU lacks) and are re-exported here; this module sits above the backend it measures.
//! - [`decision`] is made once per process, for each dtype by the first rule that applies:
//!   1. `TESSERA_CPU_PATHS` ([`ENV`], e.g. `f32=avx2,bf16=widen-avx512`; either part may be
//!      left out): reason `env override`. A malformed value, or one naming a path this CPU cannot
//!      run, is ignored as a whole with a warning in [`Decision::warnings`] (the library never
//!      prints; the CLI refuses it with exit code 2 through [`check_env_override`]).
//!   2. The CPU has one candidate only: `only candidate`.
//!   3. The stored decision `<cache dir>/dispatch-<fingerprint>.json`: `stored`. The fingerprint
//!      hashes the CPU model, the detected features, the crate version and the build profile;
//!      the directory is the one given to [`set_store_dir`] (the CLI's `--cache-dir`), else
//!      [`tessera_core::cache_dir::resolve`]`(None)` (`TESSERA_CACHE_DIR`, ...).
//!   4. Measurement: `measured`. Every candidate runs the same small forward (causal, 1 batch,
//!      2 heads, 1024 tokens, D = 64, 128×128 tiles, one thread; one 64×64 tile in debug builds):
//!      one warm-up call, then the best of up to five timed calls (at least two, stopping once a
//!      candidate has spent 25 ms). The fastest wins; ties go to the earlier path of
//!      [`F32Path::ALL`] / [`Bf16Path::ALL`]. The run records no metrics
//!      ([`tessera_core::metrics::unrecorded`]). The result is stored, created only if absent, so
//!      processes racing on a fresh machine adopt the first decision written. Not being able to
//!      store it is a warning, not an error.
//! - A stored file that cannot be read or parsed, has another format or fingerprint, or names a
//!   path this CPU cannot run is ignored with a warning, measured again and replaced.
//! - Why it persists: results are bit-identical run to run (docs/semantics.md#attention), and the `dot` and widened
//!   bf16 paths round differently (P and dS are bf16 operands on `dot`); a decision measured
//!   afresh by each process could flip between two close candidates.

use super::backend::CpuBackend;
use super::paths::env_text;
pub use super::paths::{
    check_env_override, Bf16Path, Caps, F32Path, KernelPaths, PathOverride, ENV,
};
use super::workspace::CpuWorkspace;
use crate::args::AttnInputs;
use crate::backend::{Backend, ForwardBufs};
use crate::options::AttnOptions;
use crate::par::Par;
use crate::validate::check_inputs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tessera_core::{metrics, DType, Error, Result, Tensor};

/// Version of the stored decision's format (part of the fingerprint).
const FORMAT: u32 = 1;

/// Why a dtype runs its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Fastest of the candidates, measured by this process.
    Measured,
    /// Read from the stored decision (measured by an earlier process).
    Stored,
    /// Forced by [`ENV`].
    EnvOverride,
    /// The only path this CPU runs.
    OnlyCandidate,
}

impl Reason {
    /// Its name in reports (`measured`, `stored`, `env override`, `only candidate`).
    pub fn name(self) -> &'static str {
        match self {
            Reason::Measured => "measured",
            Reason::Stored => "stored",
            Reason::EnvOverride => "env override",
            Reason::OnlyCandidate => "only candidate",
        }
    }
}

/// One candidate's measured time.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Timing<P> {
    /// The candidate.
    pub path: P,
    /// Its best time in milliseconds, `None` when it could not run.
    pub ms: Option<f64>,
}

/// The path of one dtype and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Choice<P> {
    /// The chosen path.
    pub path: P,
    /// Why.
    pub reason: Reason,
    /// Every candidate's time when the choice was measured (now or, for `stored`, by the
    /// process that stored it); empty for an override or a single candidate.
    pub candidates: Vec<Timing<P>>,
}

/// The process-wide kernel-path decision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Decision {
    /// The f32 path and why.
    pub f32: Choice<F32Path>,
    /// The bf16 path and why.
    pub bf16: Choice<Bf16Path>,
    /// Fingerprint of (CPU model, features, crate version, build profile).
    pub fingerprint: String,
    /// The stored decision file read or written (`None` when none was).
    pub file: Option<PathBuf>,
    /// What went wrong on the way (override ignored, bad file replaced, file not written).
    pub warnings: Vec<String>,
}

impl Decision {
    /// The chosen paths.
    pub fn paths(&self) -> KernelPaths {
        KernelPaths {
            f32: self.f32.path,
            bf16: self.bf16.path,
        }
    }

    /// One line: the path of `dtype` and why (e.g. `avx512 (measured 1.92 ms vs avx2 2.71 ms)`).
    pub fn describe(&self, dtype: DType) -> String {
        match dtype {
            DType::BF16 => self.describe_choice(&self.bf16),
            _ => self.describe_choice(&self.f32),
        }
    }

    fn describe_choice<P: Copy + PartialEq + Named>(&self, c: &Choice<P>) -> String {
        let ms = |t: &Timing<P>| t.ms.map_or("failed".to_string(), |m| format!("{m:.2} ms"));
        let times = || {
            let own = c.candidates.iter().find(|t| t.path == c.path);
            let others: Vec<String> = c
                .candidates
                .iter()
                .filter(|t| t.path != c.path)
                .map(|t| format!("{} {}", t.path.name(), ms(t)))
                .collect();
            match (own, others.is_empty()) {
                (Some(o), true) => ms(o),
                (Some(o), false) => format!("{} vs {}", ms(o), others.join(", ")),
                (None, _) => others.join(", "),
            }
        };
        let file = self
            .file
            .as_ref()
            .map_or("?".to_string(), |f| f.display().to_string());
        let why = match c.reason {
            Reason::Measured => match &self.file {
                Some(f) => format!("measured {}; stored in {}", times(), f.display()),
                None => format!("measured {}; not stored", times()),
            },
            Reason::Stored => match times() {
                t if t.is_empty() => format!("stored decision from {file}"),
                t => format!("stored decision from {file}: {t}"),
            },
            Reason::EnvOverride => format!("{ENV} override"),
            Reason::OnlyCandidate => "only candidate on this CPU".to_string(),
        };
        format!("{} ({why})", c.path.name())
    }
}

/// A path with a name (both path kinds).
trait Named {
    fn name(self) -> &'static str;
}
impl Named for F32Path {
    fn name(self) -> &'static str {
        F32Path::name(self)
    }
}
impl Named for Bf16Path {
    fn name(self) -> &'static str {
        Bf16Path::name(self)
    }
}

static STORE_DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
static DECISION: OnceLock<Decision> = OnceLock::new();

/// Sets the directory of the stored decision (the CLI's `--cache-dir`; `None`: store nothing).
/// Only before the first [`decision`]: returns `false`, changing nothing, once it is fixed.
pub fn set_store_dir(dir: Option<PathBuf>) -> bool {
    STORE_DIR.set(dir).is_ok()
}

/// The process-wide decision (made on first use; see the module contract).
pub fn decision() -> &'static Decision {
    DECISION.get_or_init(|| {
        let dir = STORE_DIR
            .get_or_init(|| tessera_core::cache_dir::resolve(None))
            .clone();
        let env = env_text();
        let mut d = metrics::unrecorded(|| {
            decide(
                Caps::detect(),
                env.as_deref(),
                dir.as_deref(),
                &cpu_model(),
                &mut measure,
            )
        });
        // The decision is where the library reports the environment it ran under.
        d.warnings
            .extend(tessera_core::cpu_features::hide_warning());
        d
    })
}

/// The CPU model name (`/proc/cpuinfo` on Linux), or "unknown".
pub fn cpu_model() -> String {
    if cfg!(target_os = "linux") {
        if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
            for line in info.lines() {
                if let Some((k, v)) = line.split_once(':') {
                    if k.trim() == "model name" && !v.trim().is_empty() {
                        return v.trim().to_string();
                    }
                }
            }
        }
    }
    "unknown".to_string()
}

/// Measured candidates of both dtypes.
struct Timings {
    f32: Vec<Timing<F32Path>>,
    bf16: Vec<Timing<Bf16Path>>,
}

/// What decides a dtype's timings (the real one is [`measure`]; tests pass fakes).
type Measure<'a> = dyn FnMut(&[F32Path], &[Bf16Path]) -> Timings + 'a;

/// The decision for a CPU with `caps`, given the override text, the store directory and the
/// CPU model (see the module contract).
fn decide(
    caps: Caps,
    env: Option<&str>,
    dir: Option<&Path>,
    cpu_model: &str,
    measure: &mut Measure<'_>,
) -> Decision {
    let mut warnings = Vec::new();
    let forced = match env {
        None => PathOverride::default(),
        Some(text) => match PathOverride::parse(text).and_then(|o| o.check(caps).map(|()| o)) {
            Ok(o) => o,
            Err(e) => {
                warnings.push(format!("{e}; ignored"));
                PathOverride::default()
            }
        },
    };
    let (f32c, bf16c) = (caps.f32_candidates(), caps.bf16_candidates());
    let fingerprint = fingerprint(caps, cpu_model);
    let mut file = None;
    let undecided =
        (forced.f32.is_none() && f32c.len() > 1) || (forced.bf16.is_none() && bf16c.len() > 1);
    let base = undecided.then(|| {
        let store = dir.map(|d| d.join(format!("dispatch-{fingerprint}.json")));
        let (f, b, stored_at) = stored_or_measured(
            caps,
            cpu_model,
            &fingerprint,
            store.as_deref(),
            (&f32c, &bf16c),
            measure,
            &mut warnings,
        );
        file = stored_at;
        (f, b)
    });
    let f32 = match (forced.f32, &base) {
        (Some(p), _) => forced_choice(p, Reason::EnvOverride),
        (None, Some((f, _))) => f.clone(),
        (None, None) => forced_choice(f32c[0], Reason::OnlyCandidate),
    };
    let bf16 = match (forced.bf16, &base) {
        (Some(p), _) => forced_choice(p, Reason::EnvOverride),
        (None, Some((_, b))) => b.clone(),
        (None, None) => forced_choice(bf16c[0], Reason::OnlyCandidate),
    };
    Decision {
        f32,
        bf16,
        fingerprint,
        file,
        warnings,
    }
}

fn forced_choice<P>(path: P, reason: Reason) -> Choice<P> {
    Choice {
        path,
        reason,
        candidates: Vec::new(),
    }
}

/// Both dtypes' choices from the stored file at `store`, else measured (and then stored), with
/// the file they were read from or written to.
fn stored_or_measured(
    caps: Caps,
    cpu_model: &str,
    fingerprint: &str,
    store: Option<&Path>,
    (f32c, bf16c): (&[F32Path], &[Bf16Path]),
    measure: &mut Measure<'_>,
    warnings: &mut Vec<String>,
) -> (Choice<F32Path>, Choice<Bf16Path>, Option<PathBuf>) {
    let mut replace = false;
    if let Some(path) = store {
        match std::fs::read(path) {
            Ok(bytes) => match StoredFile::parse(&bytes, caps, fingerprint) {
                Ok((f, b)) => return (f, b, Some(path.to_path_buf())),
                Err(why) => {
                    warnings.push(format!(
                        "kernel-path decision {} ignored ({why}); measured again",
                        path.display()
                    ));
                    replace = true;
                }
            },
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) => {}
            Err(e) => {
                warnings.push(format!(
                    "kernel-path decision {} unreadable ({e}); measured again",
                    path.display()
                ));
                replace = true;
            }
        }
    }
    let t = measure(f32c, bf16c);
    let f = fastest(f32c, t.f32);
    let b = fastest(bf16c, t.bf16);
    let Some(path) = store else {
        return (f, b, None);
    };
    let bytes = StoredFile::new(caps, cpu_model, fingerprint, &f, &b).to_bytes();
    let written = path
        .parent()
        .map_or(Ok(()), |d| {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))
        })
        .and_then(|()| {
            if replace {
                tessera_io::atomic_write_bytes(path, &bytes).map(|()| true)
            } else {
                tessera_io::atomic_create_bytes(path, &bytes)
            }
        });
    match written {
        Ok(true) => (f, b, Some(path.to_path_buf())),
        // Another process stored its decision first: use that one, so both agree.
        Ok(false) => match std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| StoredFile::parse(&bytes, caps, fingerprint))
        {
            Ok((f, b)) => (f, b, Some(path.to_path_buf())),
            Err(why) => {
                warnings.push(format!(
                    "kernel-path decision {} written by another process is unusable ({why}); \
                     using this process's measurement",
                    path.display()
                ));
                (f, b, None)
            }
        },
        Err(e) => {
            warnings.push(format!("kernel-path decision not stored: {e}"));
            (f, b, None)
        }
    }
}

/// The fastest measured candidate (ties: the earlier one); the first candidate when none ran.
fn fastest<P: Copy + PartialEq>(candidates: &[P], timings: Vec<Timing<P>>) -> Choice<P> {
    let mut best: Option<(P, f64)> = None;
    for &c in candidates {
        let ms = timings.iter().find(|t| t.path == c).and_then(|t| t.ms);
        if let Some(ms) = ms.filter(|m| m.is_finite()) {
            if best.is_none_or(|(_, b)| ms < b) {
                best = Some((c, ms));
            }
        }
    }
    Choice {
        path: best.map_or(candidates[0], |(p, _)| p),
        reason: Reason::Measured,
        candidates: timings,
    }
}

/// FNV-1a (64-bit) of what makes a measured decision valid: the format, CPU model, features,
/// crate version and build profile (debug builds time differently).
fn fingerprint(caps: Caps, cpu_model: &str) -> String {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let key = format!(
        "{FORMAT}|{cpu_model}|{}|{}|{profile}",
        caps.names().join(" "),
        env!("CARGO_PKG_VERSION")
    );
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The stored decision file.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredFile {
    format: u32,
    fingerprint: String,
    cpu_model: String,
    features: Vec<String>,
    version: String,
    f32: StoredChoice,
    bf16: StoredChoice,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct StoredChoice {
    path: String,
    candidates: Vec<StoredTiming>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct StoredTiming {
    path: String,
    ms: Option<f64>,
}

impl StoredFile {
    fn new(
        caps: Caps,
        cpu_model: &str,
        fingerprint: &str,
        f: &Choice<F32Path>,
        b: &Choice<Bf16Path>,
    ) -> StoredFile {
        fn choice<P: Copy + Named>(c: &Choice<P>) -> StoredChoice {
            StoredChoice {
                path: c.path.name().to_string(),
                candidates: c
                    .candidates
                    .iter()
                    .map(|t| StoredTiming {
                        path: t.path.name().to_string(),
                        ms: t.ms,
                    })
                    .collect(),
            }
        }
        StoredFile {
            format: FORMAT,
            fingerprint: fingerprint.to_string(),
            cpu_model: cpu_model.to_string(),
            features: caps.names().into_iter().map(String::from).collect(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            f32: choice(f),
            bf16: choice(b),
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        // Serializing plain strings and numbers cannot fail; an empty file would only be
        // rejected and measured again.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// The stored choices, when the file is a valid decision for this CPU; else why not.
    fn parse(
        bytes: &[u8],
        caps: Caps,
        fingerprint: &str,
    ) -> std::result::Result<(Choice<F32Path>, Choice<Bf16Path>), String> {
        let s: StoredFile = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        if s.format != FORMAT {
            return Err(format!("format {} (expected {FORMAT})", s.format));
        }
        if s.fingerprint != fingerprint {
            return Err(format!(
                "fingerprint {} (expected {fingerprint})",
                s.fingerprint
            ));
        }
        fn choice<P: Copy>(
            c: &StoredChoice,
            parse: impl Fn(&str) -> Option<P>,
            runs: impl Fn(P) -> bool,
        ) -> std::result::Result<Choice<P>, String> {
            let path = parse(&c.path)
                .filter(|&p| runs(p))
                .ok_or_else(|| format!("path {:?} is not one this CPU runs", c.path))?;
            let candidates = c
                .candidates
                .iter()
                .map(|t| {
                    let path =
                        parse(&t.path).ok_or_else(|| format!("unknown path {:?}", t.path))?;
                    Ok(Timing { path, ms: t.ms })
                })
                .collect::<std::result::Result<_, String>>()?;
            Ok(Choice {
                path,
                reason: Reason::Stored,
                candidates,
            })
        }
        Ok((
            choice(&s.f32, F32Path::parse, |p| caps.runs_f32(p))?,
            choice(&s.bf16, Bf16Path::parse, |p| caps.runs_bf16(p))?,
        ))
    }
}

/// Heads, tokens and tile edge of the measured forward. Debug builds run about a thousand times
/// slower and decide only for themselves (the build profile is in the fingerprint): one tile.
const MEASURE: (usize, usize, usize) = if cfg!(debug_assertions) {
    (1, 64, 64)
} else {
    (2, 1024, 128)
};
/// Timed calls per candidate at most, after one warm-up call.
const MAX_TIMED: usize = 5;
/// A candidate stops after this much timed work (and at least two timed calls).
const CANDIDATE_BUDGET: Duration = Duration::from_millis(25);

/// Times every candidate on the measured forward (see the module contract).
fn measure(f32c: &[F32Path], bf16c: &[Bf16Path]) -> Timings {
    let (heads, len, tile) = MEASURE;
    let plan = tessera_plan::PlanShape::new(1, heads, len, len).and_then(|shape| {
        let tile = tessera_plan::TileShape::new(tile, tile)?;
        tessera_plan::build_plan(&tessera_mask::Mask::causal(), shape, tile)
    });
    let Ok(plan) = plan.map(Arc::new) else {
        return failed(f32c, bf16c);
    };
    // Any fixed, finite inputs (NaN or inf would select the slower non-finite products).
    let n = heads * len * 64;
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut values = |_| {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let qkv: Vec<Vec<f32>> = (0..3).map(|_| (0..n).map(&mut values).collect()).collect();
    let tensors = |dtype: DType| -> Option<Vec<Tensor>> {
        let shape = vec![1, heads, len, 64];
        qkv.iter()
            .map(|v| match dtype {
                DType::BF16 => Tensor::from_bf16(
                    shape.clone(),
                    v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
                ),
                _ => Tensor::from_f32(shape.clone(), v.clone()),
            })
            .collect::<Result<Vec<_>>>()
            .ok()
    };
    let (f32_in, bf16_in) = (tensors(DType::F32), tensors(DType::BF16));
    let time = |paths: KernelPaths, t: &Option<Vec<Tensor>>| -> Option<f64> {
        let t = t.as_ref()?;
        time_forward(paths, &plan, &t[0], &t[1], &t[2])
    };
    // The other dtype's path is irrelevant to a call; portable is always runnable.
    Timings {
        f32: f32c
            .iter()
            .map(|&p| Timing {
                path: p,
                ms: time(
                    KernelPaths {
                        f32: p,
                        bf16: Bf16Path::WidenPortable,
                    },
                    &f32_in,
                ),
            })
            .collect(),
        bf16: bf16c
            .iter()
            .map(|&p| Timing {
                path: p,
                ms: time(
                    KernelPaths {
                        f32: F32Path::Portable,
                        bf16: p,
                    },
                    &bf16_in,
                ),
            })
            .collect(),
    }
}

/// Every candidate failed (the measured forward could not even be set up).
fn failed(f32c: &[F32Path], bf16c: &[Bf16Path]) -> Timings {
    Timings {
        f32: f32c.iter().map(|&path| Timing { path, ms: None }).collect(),
        bf16: bf16c
            .iter()
            .map(|&path| Timing { path, ms: None })
            .collect(),
    }
}

/// Best milliseconds of the forward on `paths` (one thread), `None` when it cannot run.
fn time_forward(
    paths: KernelPaths,
    plan: &Arc<tessera_plan::Plan>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Option<f64> {
    // `with_paths` refuses paths this CPU lacks, which keeps the kernel calls sound even for
    // a caller's wrong candidate list.
    let be = CpuBackend::with_paths(paths).ok()?;
    let prepared = be.prepare(plan).ok()?;
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).ok()?;
    let opts = AttnOptions::default();
    let dims = check_inputs(&inputs, &opts).ok()?;
    let mut out = ForwardBufs::new(&dims);
    let mut ws = CpuWorkspace::new();
    let mut call = || {
        be.forward_into(&prepared, &inputs, &opts, out.out(), &mut ws, Par::Seq)
            .ok()
    };
    call()?;
    let (mut best, mut spent) = (f64::INFINITY, Duration::ZERO);
    for i in 0..MAX_TIMED {
        let t = Instant::now();
        call()?;
        let e = t.elapsed();
        best = best.min(e.as_secs_f64() * 1e3);
        spent += e;
        if i >= 1 && spent >= CANDIDATE_BUDGET {
            break;
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::Isa;

    const ALL_CAPS: Caps = Caps {
        avx2: true,
        avx512: true,
        avx512_bf16: true,
        amx: true,
    };
    const NO_BF16: Caps = Caps {
        avx512_bf16: false,
        amx: false,
        ..ALL_CAPS
    };
    const PORTABLE_ONLY: Caps = Caps {
        avx2: false,
        avx512: false,
        avx512_bf16: false,
        amx: false,
    };

    /// A fake measurement: every listed candidate gets the time `ms(path name)`; counts calls.
    struct Fake {
        calls: usize,
        ms: fn(&str) -> f64,
    }

    impl Fake {
        fn new(ms: fn(&str) -> f64) -> Fake {
            Fake { calls: 0, ms }
        }

        fn decide(&mut self, caps: Caps, env: Option<&str>, dir: Option<&Path>) -> Decision {
            let ms = self.ms;
            let calls = &mut self.calls;
            let mut m = |f: &[F32Path], b: &[Bf16Path]| {
                *calls += 1;
                Timings {
                    f32: f
                        .iter()
                        .map(|&path| Timing {
                            path,
                            ms: Some(ms(path.name())),
                        })
                        .collect(),
                    bf16: b
                        .iter()
                        .map(|&path| Timing {
                            path,
                            ms: Some(ms(path.name())),
                        })
                        .collect(),
                }
            };
            decide(caps, env, dir, "test cpu", &mut m)
        }
    }

    /// avx2 fastest for f32, dot fastest for bf16.
    fn avx2_and_dot(name: &str) -> f64 {
        match name {
            "avx2" | "dot" => 1.0,
            "widen-avx2" => 1.5,
            "avx512" | "widen-avx512" => 2.0,
            _ => 9.0,
        }
    }

    fn store_path(dir: &Path, caps: Caps) -> PathBuf {
        dir.join(format!("dispatch-{}.json", fingerprint(caps, "test cpu")))
    }

    #[test]
    fn override_parses_and_rejects_with_the_variable_named() {
        let p = |t: &str| PathOverride::parse(t);
        assert_eq!(
            p("f32=avx2,bf16=widen-avx512").unwrap(),
            PathOverride {
                f32: Some(F32Path::Avx2),
                bf16: Some(Bf16Path::WidenAvx512)
            }
        );
        assert_eq!(
            p(" bf16 = dot ").unwrap(),
            PathOverride {
                f32: None,
                bf16: Some(Bf16Path::Dot)
            }
        );
        assert_eq!(p("bf16=bf16-dot,").unwrap().bf16, Some(Bf16Path::Dot));
        assert_eq!(p("f32=portable").unwrap().f32, Some(F32Path::Portable));
        for bad in [
            "",
            ",",
            "avx2",
            "f32=avx1024",
            "f64=avx2",
            "bf16=widen",
            "f32=avx2,f32=avx512",
            "f32=avx2;bf16=dot",
        ] {
            let e = p(bad).unwrap_err();
            assert!(
                e.is_user_error() && e.to_string().contains(ENV),
                "{bad}: {e}"
            );
        }
        let dot = p("bf16=dot").unwrap();
        assert!(dot.check(ALL_CAPS).is_ok());
        let e = dot.check(NO_BF16).unwrap_err();
        assert!(e.to_string().contains("AVX512-BF16"), "{e}");
        assert!(p("f32=avx512").unwrap().check(PORTABLE_ONLY).is_err());
        assert!(p("bf16=widen-avx2").unwrap().check(PORTABLE_ONLY).is_err());
    }

    #[test]
    fn measured_decision_is_stored_and_read_back_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let mut fake = Fake::new(avx2_and_dot);
        let first = fake.decide(ALL_CAPS, None, Some(dir.path()));
        assert_eq!(fake.calls, 1);
        assert_eq!(
            first.paths(),
            KernelPaths {
                f32: F32Path::Avx2,
                bf16: Bf16Path::Dot
            }
        );
        assert_eq!(
            (first.f32.reason, first.bf16.reason),
            (Reason::Measured, Reason::Measured)
        );
        assert_eq!(
            first.file.as_deref(),
            Some(store_path(dir.path(), ALL_CAPS).as_path())
        );
        assert!(first.warnings.is_empty(), "{:?}", first.warnings);
        assert!(first
            .describe(DType::F32)
            .starts_with("avx2 (measured 1.00 ms vs avx512 2.00 ms"));

        // A second process: the stored decision, nothing measured, same paths and timings.
        let mut other = Fake::new(|_| 1.0);
        let again = other.decide(ALL_CAPS, None, Some(dir.path()));
        assert_eq!(other.calls, 0);
        assert_eq!(again.paths(), first.paths());
        assert_eq!(
            (again.f32.reason, again.bf16.reason),
            (Reason::Stored, Reason::Stored)
        );
        assert_eq!(again.f32.candidates, first.f32.candidates);
        assert_eq!(again.bf16.candidates, first.bf16.candidates);
        assert!(again.describe(DType::BF16).contains("stored decision from"));

        // Another CPU (other features) has its own file.
        let mut third = Fake::new(|_| 1.0);
        let d = third.decide(NO_BF16, None, Some(dir.path()));
        assert_eq!((third.calls, d.f32.reason), (1, Reason::Measured));
    }

    #[test]
    fn a_bad_stored_decision_is_ignored_measured_again_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(dir.path(), ALL_CAPS);
        let valid = {
            let mut f = Fake::new(avx2_and_dot);
            f.decide(ALL_CAPS, None, Some(dir.path()));
            std::fs::read_to_string(&path).unwrap()
        };
        let other_fp = valid.replace(&fingerprint(ALL_CAPS, "test cpu"), "0000000000000000");
        let other_format = valid.replace("\"format\": 1", "\"format\": 99");
        let unknown_path = valid.replacen("\"path\": \"avx2\"", "\"path\": \"avx1024\"", 1);
        for bad in [
            "{ not json".to_string(),
            String::new(),
            other_fp,
            other_format,
            unknown_path,
        ] {
            assert_ne!(bad, valid);
            std::fs::write(&path, &bad).unwrap();
            let mut f = Fake::new(avx2_and_dot);
            let d = f.decide(ALL_CAPS, None, Some(dir.path()));
            assert_eq!(f.calls, 1, "{bad:?} must be measured again");
            assert_eq!(d.f32.reason, Reason::Measured);
            assert!(
                d.warnings.iter().any(|w| w.contains("ignored")),
                "{:?}",
                d.warnings
            );
            // Replaced by a valid file: the next process reads it.
            let mut g = Fake::new(avx2_and_dot);
            let e = g.decide(ALL_CAPS, None, Some(dir.path()));
            assert_eq!((g.calls, e.f32.reason), (0, Reason::Stored), "{bad:?}");
        }
    }

    #[test]
    fn a_stored_path_this_cpu_cannot_run_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        // A file for a CPU without BF16 that names `dot` (hand-edited, or features misread).
        Fake::new(avx2_and_dot).decide(NO_BF16, None, Some(dir.path()));
        let path = store_path(dir.path(), NO_BF16);
        let text = std::fs::read_to_string(&path).unwrap();
        let forged = text.replacen("\"path\": \"widen-avx2\"", "\"path\": \"dot\"", 1);
        assert_ne!(forged, text);
        std::fs::write(&path, forged).unwrap();
        let mut f = Fake::new(avx2_and_dot);
        let d = f.decide(NO_BF16, None, Some(dir.path()));
        assert_eq!(f.calls, 1);
        assert_eq!(d.bf16.path, Bf16Path::WidenAvx2);
    }

    #[test]
    fn chosen_paths_are_always_ones_the_cpu_runs() {
        let dir = tempfile::tempdir().unwrap();
        for bits in 0..16u8 {
            let caps = Caps {
                avx2: bits & 1 != 0,
                avx512: bits & 2 != 0,
                avx512_bf16: bits & 6 == 6, // BF16 only with AVX-512, as `Isa` detects it
                amx: bits & 14 == 14,       // AMX only with AVX512-BF16, as `Isa` supports it
            };
            for env in [
                None,
                Some("bf16=dot"),
                Some("bf16=amx"),
                Some("f32=avx512,bf16=widen-avx512"),
                Some("f32=portable"),
                Some("junk"),
            ] {
                // A measurement that (wrongly) favours the widest paths always.
                let mut f = Fake::new(|n| {
                    if n.contains("512") || n == "dot" || n == "amx" {
                        0.5
                    } else {
                        1.0
                    }
                });
                let d = f.decide(caps, env, Some(dir.path()));
                assert!(caps.runs(d.paths()), "{caps:?} {env:?}: {:?}", d.paths());
                if !caps.avx512_bf16 {
                    assert_ne!(d.bf16.path, Bf16Path::Dot, "{caps:?} {env:?}");
                }
                if !caps.amx {
                    assert_ne!(d.bf16.path, Bf16Path::Amx, "{caps:?} {env:?}");
                }
                if caps == PORTABLE_ONLY && env != Some("f32=portable") {
                    assert_eq!(f.calls, 0, "nothing to measure");
                    assert_eq!(d.f32.reason, Reason::OnlyCandidate);
                }
            }
        }
        // An override this CPU cannot run is ignored as a whole, with a warning.
        let mut f = Fake::new(avx2_and_dot);
        let d = f.decide(NO_BF16, Some("f32=avx2,bf16=dot"), None);
        assert_eq!(d.paths().bf16, Bf16Path::WidenAvx2);
        assert_eq!(
            d.f32.reason,
            Reason::Measured,
            "the f32 part is ignored too"
        );
        assert!(
            d.warnings[0].contains(ENV) && d.warnings[0].contains("ignored"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn override_wins_per_dtype_and_the_rest_is_measured() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = Fake::new(avx2_and_dot);
        let d = f.decide(ALL_CAPS, Some("bf16=widen-avx512"), Some(dir.path()));
        assert_eq!(d.bf16.path, Bf16Path::WidenAvx512);
        assert_eq!(d.bf16.reason, Reason::EnvOverride);
        assert_eq!(
            (d.f32.path, d.f32.reason),
            (F32Path::Avx2, Reason::Measured)
        );
        assert!(d.describe(DType::BF16).contains(ENV));
        // Both forced: no file is read or written, nothing measured.
        let empty = tempfile::tempdir().unwrap();
        let mut g = Fake::new(avx2_and_dot);
        let d = g.decide(ALL_CAPS, Some("f32=avx512,bf16=dot"), Some(empty.path()));
        assert_eq!((g.calls, d.file.clone()), (0, None));
        assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0);
    }

    #[test]
    fn no_usable_store_still_decides() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_dir = dir.path().join("file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        for store in [None, Some(not_a_dir.as_path())] {
            let mut f = Fake::new(avx2_and_dot);
            let d = f.decide(ALL_CAPS, None, store);
            assert_eq!((f.calls, d.file.clone()), (1, None));
            assert_eq!(d.paths().f32, F32Path::Avx2);
            assert_eq!(
                d.warnings.len(),
                usize::from(store.is_some()),
                "{:?}",
                d.warnings
            );
        }
    }

    /// Another process stores its decision while this one measures: this one adopts it.
    #[test]
    fn a_decision_stored_first_by_another_process_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(dir.path(), ALL_CAPS);
        let theirs = {
            let d = tempfile::tempdir().unwrap();
            Fake::new(|n| {
                if n == "avx512" || n == "widen-avx512" {
                    1.0
                } else {
                    2.0
                }
            })
            .decide(ALL_CAPS, None, Some(d.path()));
            std::fs::read(store_path(d.path(), ALL_CAPS)).unwrap()
        };
        let mut m = |f: &[F32Path], b: &[Bf16Path]| {
            std::fs::write(&path, &theirs).unwrap();
            Timings {
                f32: f
                    .iter()
                    .map(|&path| Timing {
                        path,
                        ms: Some(avx2_and_dot(path.name())),
                    })
                    .collect(),
                bf16: b
                    .iter()
                    .map(|&path| Timing {
                        path,
                        ms: Some(avx2_and_dot(path.name())),
                    })
                    .collect(),
            }
        };
        let d = decide(ALL_CAPS, None, Some(dir.path()), "test cpu", &mut m);
        assert_eq!(
            d.paths(),
            KernelPaths {
                f32: F32Path::Avx512,
                bf16: Bf16Path::WidenAvx512
            }
        );
        assert_eq!(d.f32.reason, Reason::Stored);
        assert_eq!(std::fs::read(&path).unwrap(), theirs);
    }

    /// The real measurement times every candidate of this CPU.
    #[test]
    fn measure_times_every_candidate_here() {
        let caps = Caps::detect();
        let t = measure(&caps.f32_candidates(), &caps.bf16_candidates());
        assert_eq!(t.f32.len(), caps.f32_candidates().len());
        assert_eq!(t.bf16.len(), caps.bf16_candidates().len());
        for ms in t
            .f32
            .iter()
            .map(|t| t.ms)
            .chain(t.bf16.iter().map(|t| t.ms))
        {
            assert!(ms.is_some_and(|m| m > 0.0 && m.is_finite()), "{ms:?}");
        }
        // Paths this CPU lacks are refused, not run.
        if !caps.avx512_bf16 {
            let t = measure(&[], &[Bf16Path::Dot]);
            assert_eq!(t.bf16[0].ms, None);
        }
    }

    /// The process-wide backend runs only paths this CPU has; never `dot` without AVX512-BF16.
    #[test]
    fn the_default_backend_runs_supported_paths() {
        let caps = Caps::detect();
        let be = CpuBackend::new();
        assert!(caps.runs(be.paths()), "{:?}", be.paths());
        if !caps.avx512_bf16 {
            assert_ne!(be.paths().bf16, Bf16Path::Dot);
            assert_ne!(be.isa_for(DType::BF16), Isa::Avx512Bf16);
        }
        assert_eq!(be.paths(), decision().paths());
        assert_eq!(be.isa_for(DType::F32), be.paths().f32.isa());
        assert_eq!(be.isa_for(DType::BF16), be.paths().bf16.isa());
    }

    #[test]
    fn with_paths_refuses_what_the_cpu_lacks() {
        let caps = Caps::detect();
        for f in F32Path::ALL {
            for b in Bf16Path::ALL {
                let paths = KernelPaths { f32: f, bf16: b };
                match CpuBackend::with_paths(paths) {
                    Ok(be) => {
                        assert!(caps.runs(paths));
                        assert_eq!(be.paths(), paths);
                    }
                    Err(e) => {
                        assert!(!caps.runs(paths));
                        assert!(matches!(e, Error::Unsupported(_)), "{e}");
                    }
                }
            }
        }
        // `with_isa` keeps meaning "both dtypes on this copy".
        if let Ok(be) = CpuBackend::with_isa(Isa::Avx512Bf16) {
            assert_eq!(
                be.paths(),
                KernelPaths {
                    f32: F32Path::Avx512,
                    bf16: Bf16Path::Dot
                }
            );
        }
        if let Ok(be) = CpuBackend::with_isa(Isa::Avx2) {
            assert_eq!(
                be.paths(),
                KernelPaths {
                    f32: F32Path::Avx2,
                    bf16: Bf16Path::WidenAvx2
                }
            );
        }
    }
}

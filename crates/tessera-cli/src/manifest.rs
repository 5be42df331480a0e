//! The run manifest (docs/semantics.md#plan-cache): what produced a result, for `tessera env` and bench output.
//!
//! Contract: [`collect`] never fails; anything it cannot find reads "unknown" (or `None`, or an
//! empty list). The git revision and rustc version are captured at build time by `build.rs`;
//! everything else is read at run time. The CPU kernel paths are the caller's decision (so
//! collecting a manifest never measures anything itself).

use std::path::Path;
use tessera::attn::cpu::dispatch::Decision;
use tessera::core::cpu_features::{self, Feature, State, HIDE_ENV};
use tessera::core::DType;

/// Build and machine facts of this run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Manifest {
    /// Version of the `tessera` crate.
    pub version: String,
    /// `git rev-parse --short HEAD` at build time, or "unknown".
    pub git_revision: String,
    /// `rustc --version` of the compiler that built this binary, or "unknown".
    pub rustc_version: String,
    /// Operating system and its release where known (e.g. `linux 6.8.0`).
    pub os: String,
    pub arch: String,
    /// CPU model name (`/proc/cpuinfo` on Linux), or "unknown".
    pub cpu_model: String,
    /// SIMD features detected at run time and not hidden, among `avx2`, `avx512f`, `avx512bf16`,
    /// `amx-bf16` (empty off x86_64).
    pub cpu_features: Vec<String>,
    /// Those of them the CPU has but `TESSERA_HIDE_ISA` hides (so the kernels do not use them).
    pub hidden_cpu_features: Vec<String>,
    /// Whether the AMX kernels run here ("AMX-BF16", or the model under `TESSERA_AMX_MODEL=1`),
    /// or why not.
    pub amx: String,
    /// Worker threads: `RAYON_NUM_THREADS` when set to a positive number (as rayon does), else
    /// the available parallelism.
    pub threads: usize,
    /// The raw `RAYON_NUM_THREADS` value, when set.
    pub rayon_num_threads: Option<String>,
    /// Plan cache directory in use (`None` with `--no-cache` or when none could be resolved).
    pub cache_dir: Option<String>,
    /// GPU and driver, filled by a GPU backend when one is present.
    pub gpu: Option<String>,
    /// The CPU kernel path of each dtype, why, and the candidates' measured times (`None` where
    /// the command runs no CPU kernels).
    pub kernel_paths: Option<Decision>,
}

/// Collects the manifest of this process, with the kernel-path decision when given.
pub fn collect(cache_dir: Option<&Path>, kernels: Option<&Decision>) -> Manifest {
    let rayon_num_threads = std::env::var("RAYON_NUM_THREADS").ok();
    let available = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = rayon_num_threads
        .as_deref()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(available);
    Manifest {
        version: env!("CARGO_PKG_VERSION").to_string(),
        git_revision: option_env!("TESSERA_GIT_REV")
            .unwrap_or("unknown")
            .to_string(),
        rustc_version: option_env!("TESSERA_RUSTC_VERSION")
            .unwrap_or("unknown")
            .to_string(),
        os: os_description(),
        arch: std::env::consts::ARCH.to_string(),
        cpu_model: tessera::attn::cpu::dispatch::cpu_model(),
        cpu_features: cpu_features(State::Available),
        hidden_cpu_features: cpu_features(State::Hidden),
        amx: match tessera::attn::cpu::amx_status() {
            Ok(on) => format!("used: {on}"),
            Err(why) => format!("not used: {why}"),
        },
        threads,
        rayon_num_threads,
        cache_dir: cache_dir.map(|p| p.display().to_string()),
        gpu: None,
        kernel_paths: kernels.cloned(),
    }
}

impl Manifest {
    /// One `key: value` line per field.
    pub fn to_text(&self) -> String {
        let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".to_string());
        let mut features = if self.cpu_features.is_empty() {
            "none".to_string()
        } else {
            self.cpu_features.join(" ")
        };
        if !self.hidden_cpu_features.is_empty() {
            features += &format!(
                " (hidden by {HIDE_ENV}: {})",
                self.hidden_cpu_features.join(" ")
            );
        }
        let threads = match &self.rayon_num_threads {
            Some(v) => format!("{} (RAYON_NUM_THREADS={v})", self.threads),
            None => self.threads.to_string(),
        };
        let mut rows = vec![
            ("tessera", self.version.clone()),
            ("git revision", self.git_revision.clone()),
            ("rustc", self.rustc_version.clone()),
            ("os", self.os.clone()),
            ("arch", self.arch.clone()),
            ("cpu", self.cpu_model.clone()),
            ("cpu features", features),
            ("amx", self.amx.clone()),
            ("threads", threads),
            ("cache dir", or_none(&self.cache_dir)),
            ("gpu", or_none(&self.gpu)),
        ];
        if let Some(d) = &self.kernel_paths {
            rows.push(("kernels", format!("f32 {}", d.describe(DType::F32))));
            rows.push(("", format!("bf16 {}", d.describe(DType::BF16))));
        }
        rows.iter()
            .map(|(k, v)| match k {
                &"" => format!("{:<13} {v}\n", ""),
                k => format!("{:<13} {v}\n", format!("{k}:")),
            })
            .collect()
    }
}

fn os_description() -> String {
    let os = std::env::consts::OS;
    match std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        Ok(r) if !r.trim().is_empty() => format!("{os} {}", r.trim()),
        _ => os.to_string(),
    }
}

/// The features `tessera env` lists that are in `state` (all absent off x86_64).
fn cpu_features(state: State) -> Vec<String> {
    [
        Feature::Avx2,
        Feature::Avx512f,
        Feature::Avx512bf16,
        Feature::AmxBf16,
    ]
    .into_iter()
    .filter(|&f| cpu_features::state(f) == state)
    .map(|f| f.name().to_string())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collect_fills_every_field() {
        let m = collect(Some(Path::new("/tmp/tc")), None);
        assert_eq!(m.version, env!("CARGO_PKG_VERSION"));
        assert!(!m.git_revision.is_empty());
        assert!(m.rustc_version.starts_with("rustc ") || m.rustc_version == "unknown");
        assert!(m.threads >= 1);
        assert_eq!(m.cache_dir.as_deref(), Some("/tmp/tc"));
        assert!(m.gpu.is_none());
        let text = m.to_text();
        for key in [
            "tessera:",
            "git revision:",
            "rustc:",
            "cpu features:",
            "threads:",
            "cache dir:",
            "gpu:",
        ] {
            assert!(text.contains(key), "{key} in {text}");
        }
        if cpu_features::has(Feature::Avx2) {
            assert!(m.cpu_features.contains(&"avx2".to_string()));
        }
        for f in &m.hidden_cpu_features {
            assert!(!m.cpu_features.contains(f), "{f} both available and hidden");
            assert!(text.contains(&format!("hidden by {HIDE_ENV}:")), "{text}");
        }
    }

    #[test]
    fn kernel_paths_are_printed_with_why() {
        use tessera::attn::cpu::dispatch::{Choice, Reason, Timing};
        use tessera::attn::cpu::{Bf16Path, F32Path};
        let timing = |path, ms| Timing { path, ms: Some(ms) };
        let d = Decision {
            f32: Choice {
                path: F32Path::Avx512,
                reason: Reason::Measured,
                candidates: vec![timing(F32Path::Avx512, 1.92), timing(F32Path::Avx2, 2.71)],
            },
            bf16: Choice {
                path: Bf16Path::Dot,
                reason: Reason::Stored,
                candidates: vec![],
            },
            fingerprint: "0123".into(),
            file: Some("/c/dispatch-0123.json".into()),
            warnings: vec![],
        };
        let text = collect(None, Some(&d)).to_text();
        let want = "kernels:      f32 avx512 (measured 1.92 ms vs avx2 2.71 ms; stored in \
                    /c/dispatch-0123.json)\n              bf16 dot (stored decision from \
                    /c/dispatch-0123.json)\n";
        assert!(text.ends_with(want), "{text}");
        assert!(!collect(None, None).to_text().contains("kernels:"));
    }
}

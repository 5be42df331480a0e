//! The `tessera` binary.
//!
//! Contract (docs/semantics.md#command-line): results on stdout (or files), progress on stderr; exit 0 on success, 2 on
//! bad usage or input, 1 on internal failure, always with one clear line on stderr and never a
//! panic or backtrace. Each subcommand lives in its own module under `cmd/`.

mod cmd;
mod ctx;
mod manifest;
mod maskload;
mod progress;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Block-sparse attention engine: plan structured masks, run exact flash attention.",
    after_help = "Example:\n  tessera demo\n  tessera plan --mask 'causal & document' --q-len 32768 --segments rows.safetensors:segment_ids"
)]
struct Cli {
    #[command(flatten)]
    global: ctx::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan a mask at tile granularity and print its statistics.
    Plan(cmd::plan::PlanArgs),
    /// Run exact attention (and gradients) on tensors from files.
    Attend(Box<cmd::attend::AttendArgs>),
    /// Benchmark attention over a suite of masks, lengths and dtypes.
    Bench(cmd::bench::BenchArgs),
    /// Plot attention telemetry (sink mass, max_logit) written as JSON lines.
    Telemetry(cmd::telemetry::TelemetryArgs),
    /// Inspect, verify or clear the persistent plan cache.
    Cache(cmd::cache::CacheArgs),
    /// Print the run manifest: versions, CPU features, threads, cache directory.
    Env(cmd::env::EnvArgs),
    /// Pack tokenized documents into fixed-length rows with segment ids.
    Pack(cmd::pack::PackArgs),
    /// Run the built-in demo on default settings.
    Demo(cmd::demo::DemoArgs),
    /// Model context-parallel shardings: balance and K/V traffic per scheme and rank count.
    CpSim(cmd::cp_sim::CpSimArgs),
}

/// Unix tools die quietly when their reader goes away (`tessera plan ... | head`); Rust ignores
/// SIGPIPE by default, which turns that into a panic on the next print.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal disposition to its default at start-up, before any threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    restore_sigpipe();
    // A bug must still end with one clear line and exit code 1, never a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("tessera: internal error: {msg}{at}");
        std::process::exit(1);
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                print!("{e}");
                return ExitCode::SUCCESS;
            }
            // One clear line: clap's message without its usage block.
            let msg = e.to_string();
            let line: Vec<&str> = msg
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:"))
                .filter(|l| !l.is_empty())
                .collect();
            let line = line.join(" ");
            eprintln!(
                "tessera: {} (see --help)",
                line.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    let ctx = ctx::Ctx::new(cli.global);
    // Every command plans or runs kernels on the CPU features left to it, so a malformed
    // TESSERA_HIDE_ISA is refused up front (the library only warns).
    let result =
        tessera::core::cpu_features::check_hide_env().and_then(|()| run(cli.command, &ctx));
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tessera: {e}");
            e.exit_code()
        }
    };
    if let Err(e) = ctx.report_metrics() {
        eprintln!("tessera: {e}");
        return ExitCode::from(1);
    }
    ExitCode::from(code as u8)
}

fn run(command: Command, ctx: &ctx::Ctx) -> tessera::core::Result<()> {
    match command {
        Command::Plan(a) => cmd::plan::run(a, ctx),
        Command::Demo(a) => cmd::demo::run(a, ctx),
        Command::Pack(a) => cmd::pack::run(a, ctx),
        Command::Cache(a) => cmd::cache::run(a, ctx),
        Command::Telemetry(a) => cmd::telemetry::run(a, ctx),
        Command::Attend(a) => cmd::attend::run(*a, ctx),
        Command::Bench(a) => cmd::bench::run(a, ctx),
        Command::Env(a) => cmd::env::run(a, ctx),
        Command::CpSim(a) => cmd::cp_sim::run(a, ctx),
    }
}

//! Progress bars on stderr, shown only when stderr is a terminal. The libraries only report
//! progress (e.g. `tessera::pack::Progress`); drawing it is the command line's job.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// A progress bar of `len` steps labelled `what`; hidden when stderr is not a terminal.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    styled(len, what, "{msg} [{bar:40}] {pos}/{len} {elapsed_precise}")
}

fn styled(len: u64, what: &str, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

/// Draws the passes of a packing run, one bar per pass, from the packer's progress reports.
#[derive(Default)]
pub struct PackBars(Option<ProgressBar>);

impl PackBars {
    /// Handles one report.
    pub fn report(&mut self, p: tessera::pack::Progress<'_>) {
        use tessera::pack::Progress;
        match p {
            Progress::Begin { label, total } => {
                self.0 = Some(styled(
                    total,
                    label,
                    "{msg} [{bar:40}] {percent:>3}% ({elapsed}, eta {eta})",
                ));
            }
            Progress::Advance(n) => {
                if let Some(b) = &self.0 {
                    b.inc(n);
                }
            }
            Progress::End => {
                if let Some(b) = self.0.take() {
                    b.finish_and_clear();
                }
            }
        }
    }
}

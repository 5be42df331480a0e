//! Progress reporting.
//!
//! Contract: a bar is drawn on stderr only when it was asked for *and* stderr is a terminal, so
//! pipes, logs and tests never see control sequences. Otherwise every call is a no-op.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

pub(crate) struct Progress(Option<ProgressBar>);

impl Progress {
    pub(crate) fn new(enabled: bool, total: u64, label: String) -> Self {
        if !enabled || !std::io::stderr().is_terminal() {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:40}] {percent:>3}% ({elapsed}, eta {eta})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(label);
        Progress(Some(bar))
    }

    pub(crate) fn inc(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.inc(n);
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

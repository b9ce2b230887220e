//! Progress of long commands (drain, prune, bench, experiment) on stderr: an indicatif bar when
//! stderr is a terminal, plain lines otherwise (at most one every `PLAIN_LINE_INTERVAL_MS`, and
//! always one at the end). stdout keeps its one JSON document either way.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Plain progress lines are at least this far apart (the last one always comes).
pub const PLAIN_LINE_INTERVAL_MS: u64 = 2_000;
/// How often a bar redraws by itself while a step runs.
const TICK_MS: u64 = 120;

/// The progress of one long command on stderr: a bar on a terminal, plain lines otherwise.
pub struct Progress {
    label: &'static str,
    /// Steps expected; 0 when unknown (a spinner, or lines without a total).
    total: u64,
    done: u64,
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Option<Instant>,
}

impl Progress {
    /// Progress of `label` over `total` steps (0: unknown).
    pub fn start(label: &'static str, total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = if total > 0 { ProgressBar::new(total) } else { ProgressBar::new_spinner() };
            bar.set_draw_target(ProgressDrawTarget::stderr());
            let template = if total > 0 {
                "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}"
            } else {
                "{prefix} [{elapsed_precise}] {spinner} {pos} {msg}"
            };
            bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
            bar.set_prefix(format!("tidemark {label}"));
            bar.enable_steady_tick(Duration::from_millis(TICK_MS));
            bar
        });
        Progress { label, total, done: 0, bar, started: Instant::now(), last_line: None }
    }

    /// `steps` more steps are done; `message` says where the command is.
    pub fn advance(&mut self, steps: u64, message: &str) {
        self.done += steps;
        match &self.bar {
            Some(bar) => {
                bar.inc(steps);
                bar.set_message(message.to_string());
            }
            None => {
                let due = match self.last_line {
                    None => true,
                    Some(last) => last.elapsed() >= Duration::from_millis(PLAIN_LINE_INTERVAL_MS),
                };
                if due {
                    self.line(message);
                }
            }
        }
    }

    fn line(&mut self, message: &str) {
        let of = if self.total > 0 { format!("/{}", self.total) } else { String::new() };
        let seconds = self.started.elapsed().as_secs_f64();
        eprintln!("tidemark {}: {}{of} after {seconds:.1}s: {message}", self.label, self.done);
        self.last_line = Some(Instant::now());
    }

    /// The end: the bar is cleared; a plain last line says how it ended.
    pub fn finish(mut self, summary: &str) {
        match self.bar.take() {
            Some(bar) => bar.finish_and_clear(),
            None => self.line(&format!("done: {summary}")),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An error ended the command: clear the bar so the terminal is left clean.
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

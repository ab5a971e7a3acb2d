//! Checks of `myo`'s command line as clap sees it.

use super::*;

/// Every flag of every subcommand says what it does (more than its default).
#[test]
fn every_flag_has_help() {
    fn check(cmd: &clap::Command, path: &str) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(
                !help.trim().is_empty() && !help.trim_start().starts_with("[default"),
                "{path} --{id}: no help"
            );
        }
        for sub in cmd.get_subcommands() {
            check(sub, &format!("{path} {}", sub.get_name()));
        }
    }
    Cli::command().debug_assert();
    check(&Cli::command(), "myo");
}

//! The `proxy-operator` binary: parses the command line and hands over to the mode asked for.

use std::process::ExitCode;

use clap::Parser;
use proxy_operator::cli::{Cli, Command};
use proxy_operator::process::{self, Exit, StartError};
use proxy_operator::resources::crd::{self, Kind};

/// jemalloc instead of glibc's malloc: a `/metrics` scrape at 10,000 proxies builds and frees
/// about 200,000 small objects, and took 40 % less CPU with it, at the same resident memory.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Crd(args) => {
            let kinds = args.kind.map_or(Kind::ALL.to_vec(), |kind| vec![kind]);
            return match crd::all_yaml(&kinds) {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    log::error!("cannot render the CRD: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::Standalone(args) => {
            runtime().and_then(|rt| rt.block_on(process::standalone::run(args)))
        }
        Command::Run(args) => runtime().and_then(|rt| rt.block_on(process::operator::run(args))),
    };
    match outcome {
        Ok(Exit::Clean) => ExitCode::SUCCESS,
        Ok(Exit::TaskFailed) => ExitCode::FAILURE,
        Err(e) => {
            log::error!("cannot start: {e}");
            ExitCode::from(2)
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, StartError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| StartError(format!("cannot start the async runtime: {e}")))
}

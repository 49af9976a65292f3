//! The `proxy-operator` binary: parses the command line and wires the parts together.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kubernetes operator for a fleet of HTTP egress proxies.
#[derive(Parser, Debug)]
#[command(name = "proxy-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the Proxy CustomResourceDefinition as YAML (what `crd/proxy.yaml` holds).
    Crd,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => match proxy_operator::crd::crd_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                log::error!("cannot render the CRD: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

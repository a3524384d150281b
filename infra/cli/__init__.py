"""`pdctl`, the operator's command line, one module per command (or tight group):

- `main`: the parser and the one error boundary (messages, exit codes, --debug);
- `common`: the consoles, the json/yaml emitter, tables, exit codes and spec-path resolution;
- one module per command: `validate`, `preview`, `render`, `eplb`, `plan`, `preflight`,
  `rollout` (rollout and rollback), `canary`, `releases`, `cost`, `policy`,
  `validate_deployment`, `diff`. Each registers its own options and stays a thin shell over `infra`.
"""

from infra.cli.common import console, err_console
from infra.cli.main import build_parser, main

__all__ = ["build_parser", "console", "err_console", "main"]

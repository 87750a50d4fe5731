"""`python -m hf_moe.cli ARGS...`, the same as `hf-moe ARGS...`: `hf_moe_cli` parses (standard library only), and
`hf_moe.commands` does the work."""

import sys

from hf_moe_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

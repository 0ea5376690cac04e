"""``python -m liquidcp_jax demo | plan | train-example``."""
from __future__ import annotations

import sys

USAGE = """usage: python -m liquidcp_jax <command> [args]

commands:
  demo      sample a batch, plan it, run MegaRing fwd+bwd and check it against the float64 reference
  plan      compare BuddyRing with the baseline placements on sampled batches (table + PNG)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from liquidcp_jax.demo import main as demo
        return demo(rest)
    if cmd == "plan":
        from liquidcp_jax.cli_plan import main as plan
        return plan(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

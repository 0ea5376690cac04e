"""``python -m liquidcp_jax COMMAND``: the ``liquidcp`` command line (:mod:`liquidcp_jax.cli`)."""
from liquidcp_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m liquidcp_jax"))

import sys

from jaxpar import interrupt

interrupt.install(defer=True)  # while the CLI's modules load (they start JAX): a Ctrl-C is noted, not raised
try:
    from jaxpar.cli import main
except BaseException:
    if not interrupt.interrupted():
        raise
if interrupt.interrupted():
    print("interrupted", file=sys.stderr)
    interrupt.exit_now()

sys.exit(main())

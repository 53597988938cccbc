"""`python -m nanogeo.tools.smoke ...`: the smoke test's command line (cli.py)."""
from nanogeo.tools.smoke.cli import main

main()

"""`python -m nanogeo.smoke ...`: the smoke test's command line (cli.py)."""
from nanogeo.smoke.cli import main

main()

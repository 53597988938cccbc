"""`python -m nanogeo.tools.perfmodel ...`: the step-time model's command line (cli.py)."""
from nanogeo.tools.perfmodel.cli import main

main()

"""`python -m nanogeo.lab.perfmodel ...`: the step-time model's command line (cli.py)."""
from nanogeo.lab.perfmodel.cli import main

main()

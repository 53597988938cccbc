"""`python -m nanogeo.lab.study ...`: the study driver's command line (cli.py)."""
from nanogeo.lab.study.cli import main

main()

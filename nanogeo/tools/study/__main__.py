"""`python -m nanogeo.tools.study ...`: the study driver's command line (cli.py)."""
from nanogeo.tools.study.cli import main

main()

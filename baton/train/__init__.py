"""Draft training (``baton train``): target-made data (data.py), online target features (online.py), the NEXTN
head (nextn.py), DSpark / DFlash drafts (dspark.py), STS calibration (calibrate.py), accept length through the
Engine (evaluate.py), the shared loop and curves (common.py, runner.py) and the command line (cli.py)."""

"""The simulator: a cost model fitted to measurements (cost.py, fit.py, validate.py; issue 35)."""

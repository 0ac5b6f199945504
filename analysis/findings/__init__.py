"""What carries a run's mismatch: ranked findings (ranking.py), the published gates they are held against
(gates.py), and the shift-share decomposition behind the cause they name (decomposition.py)."""

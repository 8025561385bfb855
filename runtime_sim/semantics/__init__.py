"""What every op computes: numpy semantics per dialect and the interpreter that runs them."""

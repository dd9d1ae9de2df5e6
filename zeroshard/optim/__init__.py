"""The sharded optimizer: flat units, gradient reduction, and the inner optimizer."""

"""Helpers shared by the op families: argument checks, backend dispatch, AOT lowering, the
chunk layout of packed sequences, the unit-lower-triangular inverse."""

"""Shape, dtype and argument rules per op, shared by the fake implementations and the launchers."""

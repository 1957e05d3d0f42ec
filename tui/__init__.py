"""edgeinfer.tui"""

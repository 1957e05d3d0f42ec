"""edgeinfer.kernels"""

"""edgeinfer.models"""

"""router/policy"""

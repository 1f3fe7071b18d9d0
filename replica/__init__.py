"""replica"""

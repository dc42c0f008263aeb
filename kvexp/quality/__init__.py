"""quality"""

"""Adapters"""

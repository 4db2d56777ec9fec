"""What runs inside every rank: the bootstrap (excepthooks, faulthandler, the error file) and the
progress beacon. Standard library and torch only, and nothing imported that a rank does not need:
this code starts before the user's script in every worker process.
"""

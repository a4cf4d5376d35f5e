from lrmoe.cli import run

run()

from fcl_emu.cli import app

app()

pub fn run(_quick: bool) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}

//! The `ep` command.

fn main() {
    println!("ep: see `ep --help`");
}
